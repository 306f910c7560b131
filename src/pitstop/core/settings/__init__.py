"""Configuration: the checkpoint configuration and its validation, and the Checkpointer's
arguments checked."""
