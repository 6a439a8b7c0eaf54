"""Weights between the trainer and the engines, what both sides share: the tensor payload format, the weight-update
group, the push check and the weight-version rule (the transports that carry them: miles.rollout.weight_transport)."""
