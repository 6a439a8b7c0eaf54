"""The rollout side: engines' controller, the executor that produces and hands over rollouts, the store."""
