"""Engine profiles: what a named engine version does with EAGLE-3 capture ids for a named model
file (tpsim.profiles.profile), every profile (registry), its replay on ids (replay) and the ids for
positions (inverse); the idealised --convention numberings are strict built-in profiles (conventions)."""
