"""A minimal KestrelLifecycleNode used to test the shared node base over DDS."""

from __future__ import annotations

import time

from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn
from std_msgs.msg import Float64

from kestrel_common.base_node import COMMAND_QOS, KestrelLifecycleNode, run_node
from kestrel_common.params import ParamSpec


class EchoNode(KestrelLifecycleNode):
    """Republishes ~/input/value * gain on ~/output/value; non-finite input is a counted drop."""

    runtime_params = frozenset({"gain"})  # read in every callback

    def __init__(self) -> None:
        super().__init__("echo", [
            ParamSpec("gain", 2.0, "Output = input * gain.", min=-10.0, max=10.0),
            ParamSpec("buffer_size", 4, "Allocated at configure.", min=1, max=64,
                      read_only=True),
            ParamSpec("offset", 0.0, "Added to the output; read at configure.", min=-10.0,
                      max=10.0),
            ParamSpec("stop_delay", 0.0, "Seconds stop_workers() takes (a slow shutdown), s.",
                      min=0.0, max=60.0),
        ])
        self._pub = None
        self._sub = None

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        if self.load_params() is None:
            return TransitionCallbackReturn.FAILURE
        self._pub = self.create_publisher(Float64, "~/output/value", COMMAND_QOS)
        self._sub = self.create_subscription(Float64, "~/input/value", self._on_value,
                                             COMMAND_QOS)
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.start_diagnostics()
        return TransitionCallbackReturn.SUCCESS

    def stop_workers(self) -> None:
        delay = self.get_parameter("stop_delay").value
        if delay > 0.0:
            print(f"stop_workers: taking {delay} s", flush=True)
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline:  # a worker that does not stop in time
                time.sleep(0.01)

    def _on_value(self, msg: Float64) -> None:
        if msg.data != msg.data or abs(msg.data) == float("inf"):
            self.drop("nonfinite_input", f"value {msg.data}")
            return
        gain = self.get_parameter("gain").value
        self._pub.publish(Float64(data=msg.data * gain + self.params["offset"]))


def main(args: list[str] | None = None) -> int:
    return run_node(EchoNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
