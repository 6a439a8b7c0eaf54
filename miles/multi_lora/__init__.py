"""The multi-LoRA run: adapters trained on one frozen base, each by its trainer group, and the tenants that join and
leave it while it runs; its schedule (the service's: admission, idle waits, withdrawal, failures) lives here."""
