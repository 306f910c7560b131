"""Sharded checkpoints (DCP directories): their layout and manifest records, and which files
cover a checkpoint across the directories ranks hold."""
