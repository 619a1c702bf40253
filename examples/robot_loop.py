"""A simulated robot running a policy served by omni-rt, with openpi-client unchanged.

The robot (a 7-joint arm and a gripper, integrating the joint velocities it is given)
runs a fixed-rate control loop. openpi-client's `ActionChunkBroker` hands it one
action per tick and calls the server only when the current chunk is used up, exactly
as on a real DROID setup.

    python examples/robot_loop.py --host 127.0.0.1 --port 8000 --hz 15 --steps 150

Prints the achieved control rate, the ticks that missed their deadline, and the
policy calls' round trips. Exit status 1 if more than --max-missed ticks missed.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from openpi_client.action_chunk_broker import ActionChunkBroker
from openpi_client.websocket_client_policy import WebsocketClientPolicy


class SimulatedArm:
    """Joint positions follow the commanded velocities; cameras show noise that
    changes with the pose (enough to make every observation different)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.joints = np.zeros(7)
        self.gripper = np.zeros(1)

    def observe(self, prompt: str) -> dict:
        img = self.rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
        return {
            "observation/exterior_image_1_left": img,
            "observation/wrist_image_left": img[::-1].copy(),
            "observation/joint_position": self.joints.copy(),
            "observation/gripper_position": self.gripper.copy(),
            "prompt": prompt,
        }

    def act(self, action: np.ndarray, dt: float) -> None:
        self.joints = np.clip(self.joints + np.tanh(action[:7]) * dt, -np.pi, np.pi)
        self.gripper = np.clip(self.gripper + np.tanh(action[7:8]) * dt, 0.0, 1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1", help="host, or a ws:// URL (e.g. ws://h:8000/v1/openpi)")
    ap.add_argument("--port", type=int, default=8000, help="port (ignored when --host is a ws:// URL)")
    ap.add_argument("--api-key")
    ap.add_argument("--hz", type=float, default=15.0, help="control rate (DROID runs at 15 Hz)")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--prompt", default="put the marker in the cup")
    ap.add_argument("--max-missed", type=int, default=None, help="fail when more ticks than this missed their deadline")
    args = ap.parse_args(argv)

    policy = WebsocketClientPolicy(args.host, None if args.host.startswith("ws") else args.port, api_key=args.api_key)
    meta = policy.get_server_metadata()
    horizon = int(meta.get("action_horizon", 10))
    print(f"policy {meta.get('policy')} layout {meta.get('layout')}: chunks of {horizon} x {meta.get('action_dim')}")

    calls: list[float] = []

    class Timed:
        def infer(self, obs: dict) -> dict:
            t = time.perf_counter()
            out = policy.infer(obs)
            calls.append(time.perf_counter() - t)
            return out

        def reset(self) -> None:
            policy.reset()

    broker = ActionChunkBroker(Timed(), action_horizon=horizon)
    arm = SimulatedArm()
    period = 1.0 / args.hz
    missed = 0
    start = time.perf_counter()
    deadline = start
    for _ in range(args.steps):
        action = broker.infer(arm.observe(args.prompt))["actions"]
        arm.act(np.asarray(action), period)
        deadline += period
        slack = deadline - time.perf_counter()
        if slack > 0:
            time.sleep(slack)
        else:
            missed += 1
    elapsed = time.perf_counter() - start
    ms = np.array(calls) * 1000
    print(f"{args.steps} ticks in {elapsed:.2f} s: {args.steps / elapsed:.2f} Hz (target {args.hz}), {missed} missed")
    print(f"{len(calls)} policy calls: round trip p50 {np.percentile(ms, 50):.1f} ms, max {ms.max():.1f} ms")
    print(f"final joints {np.round(arm.joints, 3).tolist()} gripper {np.round(arm.gripper, 3).tolist()}")
    return 1 if args.max_missed is not None and missed > args.max_missed else 0


if __name__ == "__main__":
    sys.exit(main())
