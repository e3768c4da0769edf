"""Files tpsim writes and reads: one atomic writer, captures and rank dumps, engine dump readers."""
