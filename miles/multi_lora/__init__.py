"""The multi-LoRA run: adapters trained on one frozen base, each by its trainer group (run.py), their inputs and
checks (inputs.py), the tenants that join and leave it while it runs (tenants.py: their files; admin.py: submitting,
withdrawing and listing them from outside), and its schedule with the service around it (schedule.py)."""
