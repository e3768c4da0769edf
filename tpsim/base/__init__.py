"""The bottom layer: errors, the terminal, fault injection, the atomic writer, safetensors."""
