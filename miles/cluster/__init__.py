"""The cluster a run takes: Ray started or attached, actors restarted when they die, where trainer ranks and engines
go (placement groups), and what each GPU holds."""
