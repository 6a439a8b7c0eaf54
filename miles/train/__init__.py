"""The trainer side: advantages, losses, the Arrow-to-tensor batch, and the TrainActor."""
