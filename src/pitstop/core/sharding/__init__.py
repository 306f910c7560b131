"""Sharded checkpoints (DCP directories): their layout and manifest records, the layout's wire
form in the manifest, and which files cover a checkpoint across the directories ranks hold."""
