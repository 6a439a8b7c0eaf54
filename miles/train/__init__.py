"""The trainer side: the algorithms (advantages, losses, KL, aggregation), the Arrow-to-tensor batch, the update and the TrainActor."""
