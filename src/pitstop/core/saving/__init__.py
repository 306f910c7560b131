"""What to save and keep: the save schedule, run targets, save plans, retention and pointers
(and the resume order they give)."""
