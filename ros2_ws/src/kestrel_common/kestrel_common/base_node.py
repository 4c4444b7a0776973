"""The base of every Kestrel node: a LifecycleNode with declared, validated parameters,
named drop counters on /diagnostics, QoS profiles chosen on purpose, and a main() helper.

Parameter handling (see params.py): each ParamSpec becomes a declared parameter whose
descriptor carries the description, the allowed range (as text in additional_constraints)
and read_only. Ranges are NOT put into rclpy's numeric range fields on purpose: rclpy raises
inside declare_parameter for an out-of-range override, which would crash the process at
construction; instead `load_params()` validates in on_configure and fails the transition with
a log line naming the parameter and the value. Runtime changes (`ros2 param set`) go through
the same validation in an on-set-parameters callback.
"""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
import time
from typing import Any, Callable, NoReturn, Sequence

import lifecycle_msgs.msg
import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rcl_interfaces.msg import ParameterDescriptor, SetParametersResult
from rclpy.exceptions import (InvalidParameterTypeException, InvalidParameterValueException,
                              ParameterUninitializedException)
from rclpy.clock import Clock, ClockType
from rclpy.executors import (Executor, ExternalShutdownException, MultiThreadedExecutor,
                             SingleThreadedExecutor)
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import (DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy)
from rclpy.signals import SignalHandlerOptions
from rclpy.task import Future

from kestrel_common.clock_check import ClockCheck
from kestrel_common.conversions import diagnostic_status
from kestrel_common.counters import Counters
from kestrel_common.heap import freeze_heap, thaw_heap, tune_malloc
from kestrel_common.params import (ParamError, ParamSpec, check_known_names, check_unique_names,
                                   validate_value, with_base_specs)
from kestrel_common.process_stop import (CLEANUP_GRACE_S, SignalWatch, StopSignals,  # noqa: F401
                                         exit_process)

# Sensor streams (camera, LiDAR, joint states): best effort, keep only the newest sample.
# A late frame is worthless; queues must never grow under overload.
SENSOR_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                        reliability=ReliabilityPolicy.BEST_EFFORT,
                        durability=DurabilityPolicy.VOLATILE)
# Commands, targets and results: reliable, a short queue (a lost command is a real fault).
COMMAND_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10,
                         reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.VOLATILE)
# State that late joiners need (the current plan, ground truth): reliable + transient local.
LATCHED_QOS = QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=1,
                         reliability=ReliabilityPolicy.RELIABLE,
                         durability=DurabilityPolicy.TRANSIENT_LOCAL)

_TYPE_OF = {
    bool: Parameter.Type.BOOL, int: Parameter.Type.INTEGER, float: Parameter.Type.DOUBLE,
    str: Parameter.Type.STRING,
}
_ARRAY_TYPE_OF = {
    bool: Parameter.Type.BOOL_ARRAY, int: Parameter.Type.INTEGER_ARRAY,
    float: Parameter.Type.DOUBLE_ARRAY, str: Parameter.Type.STRING_ARRAY,
}

BASE_SPECS = (
    ParamSpec("gc_freeze", True, "After a successful configure: gc.collect() once, then "
              "gc.freeze() (models and compiled graphs leave the collector's view, so no later "
              "full collection pauses the node for 100s of ms; kestrel_common.heap).",
              read_only=True),
    ParamSpec("autostart", True, "Configure and activate at start-up (no lifecycle manager).",
              read_only=True),
    ParamSpec("diagnostics_period", 1.0, "Period of /diagnostics publication, s.",
              min=0.01, max=60.0, read_only=True),
)


def _typed_only(spec: ParamSpec) -> bool:
    return isinstance(spec.default, list) and not spec.default


class KestrelLifecycleNode(LifecycleNode):
    """LifecycleNode + ParamSpecs + Counters + /diagnostics.

    Subclasses pass their specs, call `self.load_params()` in on_configure (None -> return
    FAILURE), create publishers/subscriptions there, start work in on_activate and stop it in
    on_deactivate / `stop_workers()` (which must be idempotent: run_node calls it at exit).
    """

    # parameters the node applies while active (`ros2 param set`); every other one is read at
    # configure, and a change while configured is logged as waiting for the next configure
    runtime_params: frozenset[str] = frozenset()

    def __init__(self, node_name: str, specs: Sequence[ParamSpec], **kwargs: Any) -> None:
        super().__init__(node_name, **kwargs)
        check_unique_names(specs)
        self.specs: list[ParamSpec] = with_base_specs(BASE_SPECS, specs)
        self._spec_by_name = {s.name: s for s in self.specs}
        self._decl_errors: dict[str, str] = {}
        for spec in self.specs:
            self._declare(spec)
        self.counters = Counters()
        self.params: dict[str, Any] = {}
        self._diag_pub = None
        self._diag_timer = None
        self._status_fn: Callable[[], tuple[int, str, dict]] | None = None
        self._drop_logged: dict[str, float] = {}
        self.clock_check: ClockCheck | None = None   # made at the first check_stamp()
        # run_node's stop at the process exit is under way (set before stop_workers): a worker
        # busy in a long call may be left to the exit instead of joined (see stop_workers)
        self.exiting = False
        self._drop_log_lock = threading.Lock()
        self.add_on_set_parameters_callback(self._on_set_parameters)
        # Freeze the heap after every successful configure and thaw it before cleanup/shutdown
        # (kestrel_common.heap: the frozen objects are never collected, so what cleanup drops
        # must be collectable again, and so must the node's own DDS objects at exit). rclpy
        # keeps the transition callbacks in `_callbacks` (its registration helper is private),
        # so the subclass's bound callbacks are wrapped there, once, for every node alike.
        callbacks = getattr(self, "_callbacks", None)
        states = lifecycle_msgs.msg.State
        if isinstance(callbacks, dict) and states.TRANSITION_STATE_CONFIGURING in callbacks:
            callbacks[states.TRANSITION_STATE_CONFIGURING] = self._configure_then_freeze(
                callbacks[states.TRANSITION_STATE_CONFIGURING])
            for state in (states.TRANSITION_STATE_CLEANINGUP,
                          states.TRANSITION_STATE_SHUTTINGDOWN):
                if state in callbacks:
                    callbacks[state] = self._thaw_then(callbacks[state])

    def _configure_then_freeze(self, configure: Callable[[LifecycleState], Any]
                               ) -> Callable[[LifecycleState], Any]:
        def wrapped(state: LifecycleState) -> Any:
            result = configure(state)
            if result == TransitionCallbackReturn.SUCCESS and self.params.get("gc_freeze"):
                frozen, ms = freeze_heap()
                self.get_logger().info(f"gc: collected in {ms:.0f} ms, then froze {frozen} "
                                       "objects (parameter gc_freeze)")
            return result
        return wrapped

    @staticmethod
    def _thaw_then(transition: Callable[[LifecycleState], Any]
                   ) -> Callable[[LifecycleState], Any]:
        def wrapped(state: LifecycleState) -> Any:
            thaw_heap()
            return transition(state)
        return wrapped

    # ---- parameters ---------------------------------------------------------------------
    def _descriptor(self, spec: ParamSpec) -> ParameterDescriptor:
        # dynamic_typing: `rate: 5` for a double parameter is accepted (validate_value
        # normalises int -> float); every other type error is reported at configure.
        return ParameterDescriptor(description=spec.description, read_only=spec.read_only,
                                   additional_constraints=spec.range_text(),
                                   dynamic_typing=not _typed_only(spec))

    def _declare(self, spec: ParamSpec) -> None:
        desc = self._descriptor(spec)
        etype = spec.list_element_type
        value: Any = spec.default
        if _typed_only(spec):  # an empty list default: declare by type
            value = _ARRAY_TYPE_OF[etype]
        try:
            self.declare_parameter(spec.name, value, desc)
        except (InvalidParameterTypeException, InvalidParameterValueException) as exc:
            # Wrong type in a params file / command line: keep the node alive and fail at
            # configure with a message that names the parameter.
            self._decl_errors[spec.name] = str(exc)
            self.declare_parameter(spec.name, value, desc, ignore_override=True)

    def _raw_value(self, spec: ParamSpec) -> Any:
        try:
            value = self.get_parameter(spec.name).value
        except ParameterUninitializedException:
            return spec.default
        if value is None:
            return spec.default
        if isinstance(spec.default, list):
            return list(value)
        return value

    def load_params(self) -> dict[str, Any] | None:
        """Validate every parameter. Returns the values, or None after logging the error."""
        try:
            if self._decl_errors:
                name, err = next(iter(self._decl_errors.items()))
                raise ParamError(name, "(override)", f"wrong type: {err}")
            # values from params files / -p for names this node never declared (rclpy keeps
            # them in `_parameter_overrides`; there is no public accessor)
            overrides = getattr(self, "_parameter_overrides", {})
            check_known_names(self._spec_by_name, {n: p.value for n, p in overrides.items()})
            values = {spec.name: validate_value(spec, self._raw_value(spec))
                      for spec in self.specs}
            self.validate_extra(values)
        except ParamError as exc:
            self.get_logger().error(f"configure failed: {exc}")
            return None
        self.params = values
        return values

    def validate_extra(self, values: dict[str, Any]) -> None:
        """Cross-parameter checks (override; raise ParamError)."""

    def _on_set_parameters(self, params: list[Parameter]) -> SetParametersResult:
        for p in params:
            spec = self._spec_by_name.get(p.name)
            if spec is None:
                continue
            try:
                validate_value(spec, p.value if not isinstance(spec.default, list)
                               else list(p.value))
            except ParamError as exc:
                return SetParametersResult(successful=False, reason=str(exc))
        if self.params:  # configured: say which changes wait for the next configure
            later = [p.name for p in params if p.name in self._spec_by_name
                     and p.name not in self.runtime_params
                     and _differs(p.value, self.params.get(p.name))]
            if later:
                self.get_logger().warning(
                    f"parameter(s) {later} set: read at configure, so they take effect at the "
                    "next configure (deactivate, cleanup, configure, activate); applied at run "
                    f"time: {sorted(self.runtime_params) or 'none'}")
        return SetParametersResult(successful=True)

    # ---- diagnostics --------------------------------------------------------------------
    def drop(self, reason: str, message: str, throttle_s: float = 1.0) -> None:
        """Count a dropped input under `reason` and log it, throttled per reason (rclpy's
        own throttle is per call site, which would hide a second reason logged from here)."""
        n = self.counters.inc(reason)
        now = time.monotonic()
        with self._drop_log_lock:
            if now - self._drop_logged.get(reason, -1e9) < throttle_s:
                return
            self._drop_logged[reason] = now
        self.get_logger().warning(f"dropped input ({reason}, total {n}): {message}")

    def check_stamp(self, stamp: Any) -> None:
        """Feed one timed input's header stamp to the time-source check (clock_check.py): a
        stack on two clocks becomes an ERROR on /diagnostics within about a second, naming
        the fix, instead of a silent stream of stale-input drops."""
        now = self.get_clock().now().nanoseconds
        if self.clock_check is None:
            self.clock_check = ClockCheck(
                use_sim_time=bool(self.get_parameter("use_sim_time").value))
        was = self.clock_check.mismatch
        if self.clock_check.observe(stamp.sec * 1_000_000_000 + stamp.nanosec, now) and not was:
            self.get_logger().error(self.clock_check.status())

    def start_diagnostics(self, status_fn: Callable[[], tuple[int, str, dict]] | None = None,
                          ) -> None:
        """Publish /diagnostics every diagnostics_period. status_fn -> (level, message,
        values); default: OK + all counters."""
        self._status_fn = status_fn
        if self._diag_pub is None:
            self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        period = float(self.params.get("diagnostics_period", 1.0))
        # Created once, then cancelled / reset: destroying an entity while a multi-threaded
        # executor spins can hit its wait set (InvalidHandle: destruction was requested).
        if self._diag_timer is None:
            # Steady clock: diagnostics keep flowing when sim time is paused or absent.
            self._diag_timer = self.create_timer(period, self.publish_diagnostics,
                                                 clock=Clock(clock_type=ClockType.STEADY_TIME))
        else:
            self._diag_timer.timer_period_ns = int(period * 1e9)
            self._diag_timer.reset()

    def publish_diagnostics(self) -> None:
        if self._diag_pub is None:
            return
        if self._status_fn is not None:
            level, message, values = self._status_fn()
        else:
            level, message, values = DiagnosticStatus.OK, "ok", {}
        merged = dict(self.counters.snapshot())
        merged.update(values)
        clock_error = self.clock_check.status() if self.clock_check is not None else ""
        if self.clock_check is not None:
            merged["time_source_mismatches"] = self.clock_check.mismatches
        if clock_error:
            level, message = DiagnosticStatus.ERROR, f"{clock_error}; {message}"
        arr = DiagnosticArray()
        arr.header.stamp = self.get_clock().now().to_msg()
        arr.status = [diagnostic_status(f"{self.get_name()}", self.get_fully_qualified_name(),
                                        level, message, merged)]
        self._diag_pub.publish(arr)

    def stop_diagnostics(self) -> None:
        """Stop publishing (the timer is cancelled, not destroyed: start_diagnostics resets it)."""
        if self._diag_timer is not None:
            self._diag_timer.cancel()

    # ---- lifecycle defaults ---------------------------------------------------------------
    def stop_workers(self) -> None:
        """Stop threads started by the node. Idempotent. Override.

        With `exiting` (the process ends after this stop) a daemon thread busy in a long call
        it cannot leave (a render, a scan) need not be joined to its end: once stopped it
        must publish nothing, and the process exit ends it."""

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Stop the node's work and its /diagnostics timer (override to add more)."""
        self.stop_workers()
        self.stop_diagnostics()
        return super().on_deactivate(state)

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.stop_workers()
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.stop_workers()
        return TransitionCallbackReturn.SUCCESS

    def destroy_node(self) -> None:
        """rclpy's destroy_node, then what it leaves: waitables (action servers and clients)
        and the lifecycle state machine (its services and transition publisher). Each holds
        the node's handle, and the last holder keeps the DDS participant up (until the
        garbage collector or the interpreter's exit gets to it)."""
        super().destroy_node()
        destroy_waitables(self)
        machine = getattr(self, "_state_machine", None)  # rclpy keeps it private
        if machine is not None:
            machine.destroy_when_not_in_use()


def destroy_waitables(node: Node) -> None:
    """Destroy what rclpy's destroy_node leaves of any node: its waitables (action servers and
    clients). Each holds the node's handle, and the last holder keeps the DDS participant up
    until the garbage collector or the interpreter's exit gets to it. Call after
    destroy_node."""
    for waitable in list(node.waitables):
        destroy = getattr(waitable, "destroy", None)
        if destroy is not None:
            destroy()


def make_executor(node: KestrelLifecycleNode, num_threads: int = 4) -> Executor:
    """The node's executor: its read-only `executor` parameter when it declares one, else
    'multi'. 'multi' = MultiThreadedExecutor (callbacks of different callback groups run
    concurrently); 'single' = SingleThreadedExecutor: no thread-pool hand-off and no GIL
    contention between executor threads per callback, for a node whose callbacks need not
    overlap (`kestrel_bench transport` measures both)."""
    kind = node.get_parameter("executor").value if node.has_parameter("executor") else "multi"
    if kind == "single":
        return SingleThreadedExecutor(context=node.context)
    if kind != "multi":
        raise ValueError(f"parameter 'executor' = {kind!r}: must be 'single' or 'multi'")
    return MultiThreadedExecutor(num_threads=num_threads, context=node.context)


def _differs(new: Any, old: Any) -> bool:
    """A parameter value changed (arrays from rclpy compare by their items)."""
    try:
        return list(new) != list(old) if isinstance(old, list) else bool(new != old)
    except (TypeError, ValueError):
        return True


exit_watchdog: SignalWatch | None = None  # serve_node's, from before spin() to the exit


def run_node(node_cls: type[KestrelLifecycleNode], args: list[str] | None = None,
             num_threads: int = 4) -> NoReturn:
    """main() for a Kestrel node process: serve_node, then end the process with its exit code
    (process_stop.exit_process: atexit handlers run, the interpreter's finalisation does not).
    Never returns."""
    code = serve_node(node_cls, args, num_threads)
    exit_process(code, exit_watchdog.name if exit_watchdog is not None else node_cls.__name__)


def serve_node(node_cls: type[KestrelLifecycleNode], args: list[str] | None = None,
               num_threads: int = 4) -> int:
    """run_node without the process exit: init, autostart (configure + activate), spin the
    executor until SIGINT/SIGTERM, then stop in order while the context is still valid:
    workers, executor, node (its DDS entities, the participant), context.

    Returns 0, or 2 when autostart configure/activate failed (the reason is logged)."""
    # a crash in native code (rclpy, the DDS library, torch) prints every thread's Python stack
    # to stderr (the node's log) before the process dies, instead of a bare exit code -11
    try:
        faulthandler.enable(file=sys.__stderr__, all_threads=True)
    except (AttributeError, OSError, ValueError):  # no stderr descriptor: nowhere to print it
        pass
    malloc = tune_malloc()  # before the first message: received buffers reuse heap pages
    signals = StopSignals()  # raises only once armed, inside the try below
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signals)
    # No rclpy handlers: they would shut the context down at the signal, under callbacks and
    # worker threads that still publish (process_stop's docstring). The first signal completes
    # `stopped` instead (SignalWatch), which ends the spin; the context is shut down last.
    rclpy.init(args=args, signal_handler_options=SignalHandlerOptions.NO)
    node = node_cls()
    node.get_logger().info(malloc)
    executor = make_executor(node, num_threads)
    executor.add_node(node)
    name = node.get_name()  # (not after destroy_node)
    stopped: Future = Future()
    global exit_watchdog
    exit_watchdog = SignalWatch(signals, name, on_first=lambda: stopped.set_result(True))
    code = 0
    try:
        signals.arm()  # a signal since the handlers went in raises here, inside the try
        if node.get_parameter("autostart").value:
            from lifecycle_msgs.msg import State
            node.trigger_configure()
            if node._state_machine.current_state[0] != State.PRIMARY_STATE_INACTIVE:
                node.get_logger().fatal("autostart: configure failed (see the error above)")
                code = 2
            else:
                node.trigger_activate()
                if node._state_machine.current_state[0] != State.PRIMARY_STATE_ACTIVE:
                    node.get_logger().fatal("autostart: activate failed")
                    code = 2
        signals.cooperate()  # from here on a signal ends the spin through `stopped`
        if code == 0 and not signals.stop.is_set():
            executor.spin_until_future_complete(stopped)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except RuntimeError as exc:  # rclpy's RCLError is one
        # The context shut down by someone else (rclpy.shutdown() in-process): an executor
        # between its shutdown check and building its next wait set raises "the given
        # context is not valid" instead of ExternalShutdownException. That is the same
        # orderly stop; anything raised while the context is still valid is not.
        if rclpy.ok():
            raise
        # (stderr: rclpy's logging may already be finalised with the context)
        print(f"[{name}] executor stopped at shutdown: {exc!r}", file=sys.stderr)
    finally:
        signals.disarm()  # from here on, signals only set signals.stop (see StopSignals)
        steps = _StopSteps(exit_watchdog)
        node.exiting = True
        steps.begin("workers")
        try:
            node.stop_workers()
        except Exception as exc:  # noqa: BLE001 - the rest of the shutdown must still run
            node.get_logger().error(f"stop_workers failed at exit: {exc!r}")
            code = code or 1
        steps.begin("executor")
        executor.shutdown(timeout_sec=2.0)
        steps.begin("node")
        node.destroy_node()
        steps.begin("context")
        # (uninstall_handlers=False: process_stop's docstring, step 2)
        rclpy.try_shutdown(uninstall_handlers=False)
        steps.begin("exit")
        # after the executor's threads are gone: what configure froze is collectable again
        # (a process that goes on: tests; run_node's exit does not collect)
        thaw_heap()
        # A late Ctrl-C has nothing more to stop; a SIGTERM of the Ctrl-C's burst (within the
        # grace) is ignored, a later one ends the process (the watchdog, then the default).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if time.monotonic() < (signals.stop_began() or 0.0) + CLEANUP_GRACE_S:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        began = signals.stop_began()
        if began is not None:  # (stderr: rclpy's logging is finalised with the context)
            print(f"[{name}] stopped in {time.monotonic() - began:.3f} s ({steps})",
                  file=sys.stderr)
    return code


class _StopSteps:
    """How long each step of the orderly stop took, for its log line; the step under way goes
    to the SignalWatch (named if a later SIGTERM has to end the stop)."""

    def __init__(self, watch: SignalWatch | None = None) -> None:
        self._watch = watch
        self._current = ""
        self._last = time.monotonic()
        self._took: list[tuple[str, float]] = []

    def begin(self, step: str) -> None:
        """`step` is under way from now; the one before it ended."""
        now = time.monotonic()
        if self._current:
            self._took.append((self._current, now - self._last))
        self._current, self._last = step, now
        if self._watch is not None:
            self._watch.step = step

    def __str__(self) -> str:
        return ", ".join(f"{step} {s:.3f} s" for step, s in self._took)
