"""The control plane: registry, scheduler, reconciler, agent endpoint, gateway, admin API."""
