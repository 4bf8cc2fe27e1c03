"""What `llmgw ctl` (and `llmgw node`) are made of: the admin API client (client), the verbs that
stand alone (keys, page, engine-check) and how answers read in a terminal (tables, engines)."""
