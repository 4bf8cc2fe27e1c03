"""The control plane: registry, scheduler, reconciler, agent port and links, gateway, admin API."""
