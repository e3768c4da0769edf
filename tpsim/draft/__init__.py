"""The EAGLE-3 draft: its config, its forward as the engines run it, and its checkpoint read in SpecForge's layout."""
