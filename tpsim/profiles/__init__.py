"""Engine profiles: what a named engine version does with EAGLE-3 capture ids for a named model
file (tpsim.profiles.profile), every profile (registry), and its replay on ids (replay)."""
