"""The control plane's side of token budgets: their one writer (set, removed, listed with what
each has spent), and the leader's grants of them to the gateway instances (`BudgetBook`, the
rule: `llmgw.server.state.budgets`), fed by the gateway link (`llmgw.server.links.gatewaylinks`).

- A change is written to the store first and made in memory only once written; it fires
  `changed`, so every gateway is sent the budgets again (`BudgetsChanged`, `message`).
- `serve` loads the budgets (a leader's term reads the store afresh), then keeps the book: reads
  from the ledger what each day or month budget spent before this leader began, reclaims the
  grants of instances whose link has been gone `grace_s`, and hands out what is wanted; every
  instance whose grants changed is told through `on_grants` (the feed pushes its `GrantsChanged`).
- What the feed says: an instance's link published (`link_opened`) or gone (`link_closed`), and
  each of its reports (`report`), which may hand out grants at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import trio

from llmgw.errors import shown
from llmgw.log import get_logger
from llmgw.server.errors import BudgetError, StoreError, UnknownBudget
from llmgw.server.state.budgets import PERIODS, SCOPES, BudgetBook
from llmgw.server.state.keys import KEY_NAME, KEY_NAME_RULE, MODEL_NAME, KeyRing
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.server.store.budgetrows import Budget
from llmgw.wakeup import Wakeup
from llmgw.wire import gateway_link as g

log = get_logger("llmgw.budgets")

MAX_TOKENS = 10**15  # far above any period's use, far inside the 64-bit integers the store keeps
LEDGER_RETRY_S = 5.0  # a ledger read the store refused is tried again after this


class BudgetRing:
    def __init__(
        self,
        store: AsyncStore,
        keys: KeyRing,
        *,
        grace_s: float,
        hold_off_s: float,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """`grace_s`: how long a closed link's grant stays counted (past the gateway's own
        detection of a dead link); `hold_off_s`: how long a new leader hands out nothing."""
        self.store = store
        self.keys = keys
        self.wall = wall
        self.book = BudgetBook(started=wall(), grace_s=grace_s, hold_off_s=hold_off_s)
        self.version = 0
        self.loaded = False
        self.changed = Wakeup()  # the budgets changed: the gateways are sent them again
        self.work = Wakeup()  # something for `serve` to look at: a base to read, a link gone
        self.on_grants: Callable[[Iterable[str]], None] = lambda instances: None

    # -- administration -------------------------------------------------------------------

    async def set(self, scope_kind: str, scope: str, model: str, period: str, tokens: int) -> tuple[Budget, bool]:
        """Set a budget (a new one, or a new amount for one there); (it, whether it is new)."""
        if scope_kind not in SCOPES:
            raise BudgetError(f"a budget is a key's or a team's, got {shown(scope_kind)}: name --key or --team")
        if not isinstance(scope, str) or not KEY_NAME.fullmatch(scope):
            raise BudgetError(f"{scope_kind} name {shown(scope)} is not valid: {KEY_NAME_RULE}")
        if scope_kind == "key" and scope not in {r.name for r in self.keys.valid()}:
            raise BudgetError(f"no valid key named {scope!r}; see `llmgw ctl keys list`")
        if scope_kind == "team" and not await self.store.has_team(scope):
            raise BudgetError(
                f"no team named {scope!r}; see `llmgw ctl teams list`, or make it with `llmgw ctl teams create`"
            )
        if not isinstance(model, str) or (model and not MODEL_NAME.fullmatch(model)):
            raise BudgetError(f"model {shown(model)} is not a model name; leave it out for every model")
        if period not in PERIODS:
            raise BudgetError(f"period {shown(period)} is none of {', '.join(PERIODS)}")
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= MAX_TOKENS:
            raise BudgetError(f"tokens must be a whole number from 1 to {MAX_TOKENS}, got {shown(tokens)}")
        budget = Budget(
            scope_kind=scope_kind, scope=scope, model=model, period=period, tokens=tokens, created_at=self.wall()
        )
        new = await self.store.set_budget(budget)
        if not new:
            budget = next((b for b in await self.store.budgets() if b.id == budget.id), budget)
        self._apply([*(b for b in self.book.budgets.values() if b.id != budget.id), budget])
        return budget, new

    async def remove(self, budget_id: str) -> Budget:
        budget = self.book.budgets.get(budget_id)
        if not await self.store.remove_budget(budget_id) or budget is None:
            known = ", ".join(sorted(self.book.budgets)) or "none"
            raise UnknownBudget(f"no budget {budget_id!r} (budgets: {known}); see `llmgw ctl budgets list`")
        self._apply([b for b in self.book.budgets.values() if b.id != budget_id])
        return budget

    async def views(self) -> list[dict]:
        """Every budget with what it spent in its period now, what is handed out and not spent,
        and what remains (None where not known: a minute's, whose shares each gateway keeps)."""
        now = self.wall()
        out = []
        for budget in sorted(self.book.budgets.values(), key=lambda b: b.id):
            view = {
                "id": budget.id,
                "scope_kind": budget.scope_kind,
                "scope": budget.scope,
                "model": budget.model,
                "period": budget.period,
                "tokens": budget.tokens,
                "created_at": budget.created_at,
                "period_start": None,
                "resets_at": None,
                "spent": None,
                "outstanding": None,
                "remaining": None,
            }
            account = self.book.account(budget.id, now)
            if account is not None:
                view.update(account.view())
                if view["spent"] is None:  # this leader has not read its ledger yet: read it now
                    spent = await self._ledger_spent(budget, account.start)
                    view.update(spent=spent, remaining=max(0, budget.tokens - spent))
            out.append(view)
        return out

    def message(self) -> g.BudgetsChanged:
        return g.BudgetsChanged(
            budgets=tuple(b.wire() for _, b in sorted(self.book.budgets.items())), version=self.version
        )

    def _apply(self, budgets: Iterable[Budget]) -> None:
        self.book.set_budgets(budgets)
        self.version += 1
        self.changed.fire()
        self.work.fire()

    # -- the link's -----------------------------------------------------------------------

    def link_opened(self, instance: str) -> None:
        self.book.link_opened(instance)

    def link_closed(self, instance: str) -> None:
        self.book.link_closed(instance, self.wall())
        self.work.fire()

    def report(self, instance: str, report: g.BudgetReport) -> None:
        now = self.wall()
        self.book.report(instance, report, now)
        if any(a.base is None for a in self.book.accounts.values()):
            self.work.fire()
        self._plan(now, [use.budget_id for use in report.budgets])

    def grants(self, instance: str) -> g.GrantsChanged:
        return g.GrantsChanged(grants=self.book.grants(instance, self.wall()))

    def _plan(self, now: float, budget_ids: list[str] | None = None) -> None:
        if not self.loaded:
            return
        changed = self.book.plan(now, budget_ids)
        if changed:
            self.on_grants(changed)

    # -- the leader's loop ----------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the budgets, then keep the book until cancelled."""
        self.book.set_budgets(await self.store.budgets())
        self.version = 1
        self.loaded = True
        self.changed.fire()
        task_status.started()
        while True:
            work = self.work.next()
            now = self.wall()
            # The ledger is read once the hold-off is over: by then the gateways linked again
            # have sent the usage reports the restart left unacknowledged.
            holding_off = now < self.book.started + self.book.hold_off_s
            for account in [] if holding_off else self.book.needs_base(now):
                try:
                    spent = await self._ledger_spent(account.budget, account.start)
                except StoreError as exc:  # the grants of this budget wait; the rest goes on
                    log.warning(
                        "budget_ledger_unread", budget=account.budget.id, reason=str(exc), retry_s=LEDGER_RETRY_S
                    )
                    break
                self.book.set_base(account.budget.id, account.start, spent)
            self.book.expire(now)
            self._plan(now)
            wake_at = [t for t in (self.book.next_expiry(), self.book.started + self.book.hold_off_s) if t and t > now]
            if not holding_off and any(a.base is None for a in self.book.accounts.values()):
                wake_at.append(now + LEDGER_RETRY_S)
            with trio.move_on_after(min(wake_at) - now if wake_at else float("inf")):
                await work.wait()

    async def _ledger_spent(self, budget: Budget, start: int) -> int:
        query = {"key": budget.scope} if budget.scope_kind == "key" else {"team": budget.scope}
        totals = await self.store.usage(**query, model=budget.model, since=start, group=())
        return sum(t.prompt_tokens + t.completion_tokens for t in totals)
