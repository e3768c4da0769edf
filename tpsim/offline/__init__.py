"""Everything that reads files and starts no rank: diagnose, align, dump readers, references, verify."""
