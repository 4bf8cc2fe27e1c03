"""The cluster's state and scheduling: the nodes (registry), the operator's intent, the
catalog turned into placements (replicas, the pure scheduler), moves and drains, the reconciler
(liveness), what each node is told (desired), the gateway's API keys, the views of all of it
(views, clusterviews) and the gateway's rotation (rotation).
"""
