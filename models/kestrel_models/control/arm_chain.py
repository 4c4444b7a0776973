"""Batched forward kinematics of a serial arm, read from a compiled MuJoCo model.

`ArmChain(model, joint_names, base_body, ee_site)` walks from the end-effector site up to the
base body and keeps, per body on the way, its fixed pose in its parent and its hinge joint (if
any). `ee_position(q)` then gives the site's position in the base frame for a batch of joint
vectors q [B, n] rad -> [B, 3] m, in float64 numpy, with no MuJoCo call: the training
environment needs it for thousands of arms per step. It equals MuJoCo's own site_xpos
(transformed into the base frame) to rounding (test_reach_env.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import mujoco
import numpy as np


def _quat_to_mat(q: np.ndarray) -> np.ndarray:
    w, x, y, z = q
    return np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
                     [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
                     [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)]])


def _axis_rotations(axis: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """Rodrigues: rotations about the unit `axis` [3] by `angles` [B] rad -> [B, 3, 3]."""
    x, y, z = axis
    k = np.array([[0.0, -z, y], [z, 0.0, -x], [-y, x, 0.0]])
    s, c = np.sin(angles)[:, None, None], np.cos(angles)[:, None, None]
    return np.eye(3) + s * k + (1.0 - c) * (k @ k)


class ArmChain:
    """The base -> end-effector chain of a MuJoCo model (see the module docstring)."""

    def __init__(self, model: mujoco.MjModel, joint_names: Sequence[str], base_body: str,
                 ee_site: str) -> None:
        def ident(kind: mujoco.mjtObj, name: str, param: str) -> int:
            i = mujoco.mj_name2id(model, kind, name)
            if i < 0:
                raise ValueError(f"parameter '{param}' = {name!r}: not in the model")
            return i

        base = ident(mujoco.mjtObj.mjOBJ_BODY, base_body, "base_body")
        site = ident(mujoco.mjtObj.mjOBJ_SITE, ee_site, "ee_site")
        self.joint_ids = [ident(mujoco.mjtObj.mjOBJ_JOINT, j, "joint_names") for j in joint_names]
        index = {j: k for k, j in enumerate(self.joint_ids)}
        links = []  # root -> tip: (pos [3], rot [3,3], joint index in q or -1, axis, anchor)
        body = int(model.site_bodyid[site])
        while body != base:
            if body == 0:
                raise ValueError(f"parameter 'ee_site' = {ee_site!r}: not below the base "
                                 f"body {base_body!r}")
            jnts = [j for j in range(model.njnt) if model.jnt_bodyid[j] == body]
            if len(jnts) > 1 or any(model.jnt_type[j] != mujoco.mjtJoint.mjJNT_HINGE
                                    for j in jnts):
                raise ValueError(f"parameter 'ee_site' = {ee_site!r}: body "
                                 f"{mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_BODY, body)!r}"
                                 " on the chain has other than one hinge joint")
            k = -1
            if jnts:
                if jnts[0] not in index:
                    name = mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_JOINT, jnts[0])
                    raise ValueError(f"parameter 'joint_names' = {list(joint_names)}: joint "
                                     f"{name!r} on the end effector's chain is missing")
                k = index[jnts[0]]
            links.append((model.body_pos[body].copy(), _quat_to_mat(model.body_quat[body]), k,
                          model.jnt_axis[jnts[0]].copy() if jnts else None,
                          model.jnt_pos[jnts[0]].copy() if jnts else None))
            body = int(model.body_parentid[body])
        self._links = links[::-1]
        self._site_pos = model.site_pos[site].copy()
        self._site_rot = _quat_to_mat(model.site_quat[site])
        self.num_joints = len(self.joint_ids)

    def ee_position(self, q: np.ndarray) -> np.ndarray:
        """End-effector positions [B, 3] m in the base frame for joint vectors q [B, n] rad."""
        q = np.atleast_2d(np.asarray(q, dtype=np.float64))
        b = q.shape[0]
        rot = np.broadcast_to(np.eye(3), (b, 3, 3)).copy()
        pos = np.zeros((b, 3))
        for link_pos, link_rot, k, axis, anchor in self._links:
            pos = pos + rot @ link_pos
            rot = rot @ link_rot
            if k >= 0:
                r = _axis_rotations(axis, q[:, k])
                # rotation about the axis through `anchor` (body frame): p -> a + R (p - a)
                if anchor.any():
                    pos = pos + np.einsum("bij,bj->bi", rot, anchor - r @ anchor)
                rot = rot @ r
        return pos + rot @ self._site_pos
