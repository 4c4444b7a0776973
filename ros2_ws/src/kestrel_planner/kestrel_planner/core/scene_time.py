"""Whether the latest scene may be planned against: its stamp against the node's clock (pure).

The planner node passes every reading of its clock through `observe(now_ns)` and every
perception result's stamp through `take(stamp_ns, now_ns)`; before planning, `refusal(now_ns)`
says why the latest scene must not be used ('' = use it), so the goal is refused with it:
- max_scene_age (s, > 0): no scene yet, or the scene older than that (now - its stamp);
- time jumped back (kestrel_common.time_jump: the clock went back more than JUMP_BACK_S, as
  at a sim restart or a bag played with --loop): the scene from before describes the world
  before the restart, however its stamp compares with the clock now. It is forgotten, and
  goals are refused until a perception result arrives after the jump; `observe` returns True,
  so that the node forgets its other inputs and aborts a running plan too;
- a scene stamped more than JUMP_BACK_S after now: from before a jump (still on its way when
  the clock went back), or stamped on another clock. take() does not keep it (and says why,
  for the node to count); refused when kept before the clock went back.
max_scene_age <= 0 turns the stamp checks off (a scene is planned against as received);
a jump still forgets the scene.
"""

from __future__ import annotations

from kestrel_common.time_jump import ClockJumps

# s: a step back of the node clock larger than this is a time jump; a scene stamped more than
# this after now is from before one (or from another clock). Sim time never goes back within
# one run; a wall clock stepped by NTP moves by milliseconds.
JUMP_BACK_S = 1.0


class SceneTime:
    """The latest scene's stamp and the node clock's jumps (see the module docstring). Not
    thread-safe: the node calls it under its lock."""

    def __init__(self, max_age_s: float, jump_back_s: float = JUMP_BACK_S) -> None:
        self.max_age_s = float(max_age_s)
        self.clock = ClockJumps(jump_back_s)
        self.stamp_ns: int | None = None  # the latest scene's header stamp, ns
        self._jumped = False  # the clock jumped back and no scene came since

    def observe(self, now_ns: int) -> bool:
        """One reading of the node clock, ns; True when it jumped back (the scene is then
        forgotten)."""
        if not self.clock.observe(now_ns):
            return False
        self.stamp_ns, self._jumped = None, True
        return True

    def _ahead_s(self, stamp_ns: int, now_ns: int) -> float:
        return (stamp_ns - now_ns) * 1e-9

    def take(self, stamp_ns: int, now_ns: int) -> str:
        """A perception result stamped `stamp_ns` arrived: kept as the latest scene ('') or
        not (the reason)."""
        self.observe(now_ns)
        ahead = self._ahead_s(stamp_ns, now_ns)
        if self.max_age_s > 0 and ahead * 1e9 > self.clock.jump_back_ns:
            return (f"perception result stamped {ahead:.1f} s after this node's clock: from "
                    "before a time jump back (a sim restart, a bag loop), or stamped on "
                    "another clock: not planned against")
        self.stamp_ns, self._jumped = stamp_ns, False
        return ""

    def refusal(self, now_ns: int) -> str:
        """Why a goal must not be planned against the latest scene now ('' when it may)."""
        self.observe(now_ns)
        if self.max_age_s <= 0:
            return ""
        if self.stamp_ns is None:
            if self._jumped:
                return (f"no perception result since time jumped back "
                        f"{self.clock.last_jump_s:.1f} s (a sim restart, a bag loop?): the "
                        "scene from before the jump is not planned against (max_scene_age)")
            return ("no perception result received yet: no scene to plan against "
                    "(max_scene_age; 0 disables the check)")
        age = -self._ahead_s(self.stamp_ns, now_ns)
        if age > self.max_age_s:
            return (f"the scene is {age:.1f} s old, more than max_scene_age "
                    f"{self.max_age_s} s: are perception results arriving, stamped with "
                    "this node's clock?")
        if -age * 1e9 > self.clock.jump_back_ns:
            return (f"the scene is stamped {-age:.1f} s after this node's clock: from before "
                    "a time jump back, or from another clock (max_scene_age)")
        return ""

    def clear(self) -> None:
        """Forget the scene and the clock (cleanup)."""
        self.stamp_ns, self._jumped = None, False
        self.clock.reset()
