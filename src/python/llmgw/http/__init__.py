"""HTTP/1.1 serving shared by the control plane (gateway, admin API) and the sim engine: the h11
adapter with its deadlines and containment (`server`), and capped listeners (`listeners`)."""
