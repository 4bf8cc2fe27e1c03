"""The requests waiting for a replica, model by model (`Queues`): how many wait now, since when the
oldest has, and the wake-up each model's waiters sleep on. Pure state, no I/O, no clock of its own.

A waiting request holds a `Ticket` from `enter` until `leave` (in a `finally`: however its wait
ends). A model's tickets are kept in the order they came, so its oldest is the first; a model with
none waiting has no `ModelQueue`, and a request that finds a replica free at once costs nothing
here. A request that lets go of a replica wakes the waiters of that replica's model only
(`wake`): requests held for a model that is starting from zero are not woken by every answer of
the models that serve meanwhile. A change that may concern any model (a new rotation, a replica
back in rotation) wakes them all (`wake_all`).

Invariants: `queued[m]` is the number of tickets of `m` in its queue; `shared` the number of
tickets taken under the gateway's own bound (`[gateway] max_queue`, models without one of their
own), each counted and uncounted where it was taken, whatever a new rotation says of its model
meanwhile.
"""

from __future__ import annotations

from llmgw.wakeup import Wakeup


class ModelQueue:
    """One model's waiting requests, oldest first, and what wakes them."""

    __slots__ = ("since", "freed")

    def __init__(self) -> None:
        self.since: dict[Ticket, float] = {}  # each waiting request -> when it began to wait, in that order
        self.freed = Wakeup()  # a replica of the model may have become free


class Ticket:
    """One request's place in its model's queue, from `Queues.enter` to `Queues.leave`."""

    __slots__ = ("model", "shared", "queue")

    def __init__(self, model: str, shared: bool, queue: ModelQueue) -> None:
        self.model, self.shared, self.queue = model, shared, queue


class Queues:
    def __init__(self) -> None:
        self.queued: dict[str, int] = {}  # waiting now, per model (0 kept once it had some: the gauge says so)
        self.shared = 0  # waiting under the gateway's own bound: requests of models without a bound of their own
        self._models: dict[str, ModelQueue] = {}  # those with a request waiting

    def enter(self, model: str, now: float, *, shared: bool) -> Ticket:
        """A request of `model` begins to wait at `now`; `shared`: it counts against the gateway's
        own bound."""
        queue = self._models.get(model)
        if queue is None:
            queue = self._models[model] = ModelQueue()
        ticket = Ticket(model, shared, queue)
        queue.since[ticket] = now
        self.queued[model] = len(queue.since)
        self.shared += shared
        return ticket

    def leave(self, ticket: Ticket) -> None:
        """Its wait ended: it has a replica, was refused, or its client went away."""
        queue = ticket.queue
        del queue.since[ticket]
        self.queued[ticket.model] = len(queue.since)
        self.shared -= ticket.shared
        if not queue.since:
            del self._models[ticket.model]

    def oldest_wait(self, model: str, now: float) -> float:
        """How long the request of `model` waiting longest has waited (0: none waits)."""
        queue = self._models.get(model)
        if queue is None:
            return 0.0
        return max(0.0, now - next(iter(queue.since.values())))

    def wake(self, model: str) -> None:
        """A replica of `model` may have become free: its waiters look again."""
        queue = self._models.get(model)
        if queue is not None:
            queue.freed.fire()

    def wake_all(self) -> None:
        for queue in self._models.values():
            queue.freed.fire()
