"""Leadership, when several control planes share one PostgreSQL store: the lease (`leader`), the
seat a server takes (`seat`), a standby's two ports (`standby`), and what a standby holds ready
to lead (`warm`).
"""
