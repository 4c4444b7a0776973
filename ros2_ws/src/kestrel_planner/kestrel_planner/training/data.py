"""Generated planner training pairs: (rendered image, scene objects, instruction) -> plan text.

A scene is a random subset of the object universe (colour x shape objects, the bin, and the
table and robot that perception also reports) at random table positions (m, perception frame).
An instruction comes from a template of its kind, with paraphrases (templates, polite frames)
and synonyms (colours, shapes, the bin). The target is the plan text form (plan.py):

    kind        example instruction                          plan
    place       put the crimson block in the basket          pick red_cube / place bin
    stack       stack the red cube on the blue can           pick red_cube / place blue_cylinder
    pick        grab the green brick                         pick green_cube
    move_to     hover over the yellow tube                   move_to yellow_cylinder
    push        nudge the blue block                         push blue_cube
    home        go back to the home position                 home
    open/close  open the gripper                                open_gripper
    place_home  put the red cube in the bin, then go home     pick / place / home
    absent      any of the above naming an object that is not in the scene
                                                              refuse absent_object
    unsupported throw the red cube; pick up the table           refuse unsupported_action

An unsupported action is refused as such even when its object is absent. Templates and polite
frames are split: `split="train"` never uses a held-out template or frame; `split="heldout"`
uses only held-out ones (with the same vocabulary of synonyms). Scenes are drawn from the
generator's seed, so evaluation scenes come from seeds the training never used.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from kestrel_planner.core.plan import END, REFUSE

__all__ = ["COLOURS", "SHAPES", "OBJECT_NAMES", "Sample", "SampleGenerator", "render_scene",
           "KINDS"]

COLOURS: dict[str, tuple[str, ...]] = {
    "red": ("red", "crimson", "scarlet"),
    "green": ("green", "emerald", "lime"),
    "blue": ("blue", "navy", "azure"),
    "yellow": ("yellow", "golden", "amber"),
}
RGB = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220),
       "yellow": (230, 210, 40)}
SHAPES: dict[str, tuple[str, ...]] = {
    "cube": ("cube", "block", "brick"),
    "cylinder": ("cylinder", "can", "tube"),
}
BIN_WORDS = ("bin", "basket", "container", "tray", "box")
OBJECT_NAMES = tuple(f"{c}_{s}" for c in COLOURS for s in SHAPES)
FIXTURES = ("table", "robot")  # reported by perception; never manipulated

# Actions outside the skill set (refused). Many verbs, so that the planner learns to refuse
# whatever is not a skill rather than a list; the held-out verbs (kick, dance) are never here.
_VERBS = ("throw", "break", "eat", "smash", "wash", "fold", "lick", "bite", "burn", "melt",
          "bend", "twist", "squeeze", "polish", "juggle", "hide", "bury", "shake", "spin",
          "crush", "tear", "sell", "hit", "punch", "hammer", "drill", "weld", "tape", "wrap",
          "count", "sniff", "cook", "freeze", "heat", "inflate", "scratch", "stomp", "slap",
          "kiss", "tickle", "shoot", "peel", "chop", "dissolve", "explode", "pour", "sew",
          "smell", "paint", "cut", "crack", "rip", "dent", "scrub", "boil", "fry", "toss",
          "stab", "saw", "grind", "sand", "carve", "stretch", "squash", "flatten", "pop",
          "drown", "splash", "rub", "hug", "feed", "wave", "nail", "pierce", "roast", "bake")
# what may follow a refused verb: the refusal does not hang on the sentence ending there.
# Physical complements only: a tail that reads like a courtesy ("for fun") taught the planner
# to refuse requests that end in one ("... for me")
_TAILS = ("", " into pieces", " on the floor", " with a hammer", " against the wall",
          " to bits", " in half", " with a knife")
UNSUPPORTED_TRAIN: tuple[str, ...] = tuple(
    f"{v} {{o}}{t}" for i, v in enumerate(_VERBS) for t in (_TAILS[0], _TAILS[1 + i % 7])) + (
    "paint {o} blue", "cut {o} in half", "throw {o} in {d}", "glue {o} to {d}",
    "roll {o} off the table", "sing a song", "fly to the moon", "pick up the table",
    "lift the robot", "paint the table", "tell me a joke", "make some coffee",
    "open the door", "turn off the lights", "walk to the kitchen", "jump", "clean the room",
    "move the table", "push the robot", "play music", "write a poem")

# (train templates, held-out templates) per kind; {o}: the object, {d}: the destination
TEMPLATES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "place": (("put {o} in {d}", "place {o} into {d}", "drop {o} in {d}", "move {o} to {d}",
               "put {o} inside {d}", "pick up {o} and put it in {d}", "store {o} in {d}",
               "grab {o} and drop it into {d}", "{o} goes in {d}", "set {o} in {d}",
               "carry {o} to {d}", "bring {o} over to {d}", "transfer {o} into {d}",
               "get {o} into {d}", "move {o} into {d}", "lift {o} and drop it in {d}",
               "pick {o} up and place it in {d}", "i need {o} in {d}", "take {o} to {d}"),
              ("i want {o} in {d}", "grab {o} and place it in {d}", "drop {o} inside {d}",
               "take {o} and put it into {d}")),
    "stack": (("put {o} on {d}", "stack {o} on top of {d}", "place {o} onto {d}",
               "set {o} on {d}", "stack {o} on {d}", "put {o} onto {d}", "rest {o} on {d}",
               "pile {o} on {d}"),
              ("stack {o} onto {d}", "put {o} on top of {d}")),
    "pick": (("pick up {o}", "grab {o}", "lift {o}", "pick {o} up", "take {o}", "grasp {o}",
              "get {o}", "raise {o}", "hold {o}", "pick {o}", "grab {o} and hold it"),
             ("lift up {o}", "grab hold of {o}")),
    "move_to": (("move above {o}", "go to {o}", "hover over {o}", "move over {o}",
                 "go above {o}", "approach {o}", "move the arm over {o}", "position over {o}",
                 "reach over {o}"),
                ("hover above {o}", "go over to {o}")),
    "push": (("push {o}", "shove {o}", "nudge {o}", "push {o} forward", "push {o} away",
              "poke {o}", "bump {o}", "give {o} a shove"),
             ("give {o} a push", "nudge {o} forward")),
    "home": (("go home", "return home", "go back to the home position", "move to home",
              "return to home", "head home", "go to the home pose"),
             ("go back home", "return to the home position")),
    "open_gripper": (("open the gripper", "open your hand", "release the gripper",
                      "open the fingers", "release", "open the robot hand", "open your gripper",
                      "open up your fingers", "let go", "open the claw"),
                     ("open the hand",)),
    "close_gripper": (("close the gripper", "close your hand", "close the fingers",
                       "close the robot hand", "close your gripper", "close the claw"),
                      ("close the hand",)),
    "place_home": (("put {o} in {d} and then go home", "drop {o} into {d} then return home",
                    "place {o} in {d} and go home", "store {o} in {d} and return home",
                    "move {o} to {d}, then go home"),
                   ("put {o} into {d}, then go back home",)),
    "unsupported": (UNSUPPORTED_TRAIN,
                    ("kick {o}", "throw {o} at the wall", "break {o} in two",
                     "dance for me", "pick up the robot")),
}
FRAMES = ((("", ""), ("please ", ""), ("", " please"), ("robot, ", ""), ("", " now"),
           ("now ", ""), ("", " thanks"), ("can you ", ""), ("would you ", ""),
           ("i need you to ", ""), ("please, ", ""), ("", " quickly"), ("ok robot, ", ""),
           ("", " thank you")),
          (("could you ", ""), ("kindly ", ""), ("", " for me"), ("hey robot, ", ""),
           ("", " right away")))
KINDS = ("place", "stack", "pick", "move_to", "push", "home", "open_gripper", "close_gripper",
         "place_home", "unsupported")
_WEIGHTS = (28, 8, 10, 8, 7, 4, 3, 3, 7, 10)
ABSENT_P = 0.3  # share of object-naming requests whose object is not in the scene
TABLE_X, TABLE_Y, TABLE_Z = (0.3, 0.8), (-0.4, 0.4), 0.425  # m


@dataclass
class Sample:
    """objects: scene object names in prompt order; positions: name -> (x, y, z) m;
    plan: the target plan text (ends with 'end'); kind: the template kind or 'absent'."""

    instruction: str
    objects: list[str]
    positions: dict[str, tuple[float, float, float]]
    plan: str
    kind: str
    template: str


def _phrase(rng: random.Random, name: str) -> str:
    if name == "bin":
        return "the " + rng.choice(BIN_WORDS)
    colour, shape = name.split("_")
    return f"the {rng.choice(COLOURS[colour])} {rng.choice(SHAPES[shape])}"


class SampleGenerator:
    """Random samples of one split ('train' | 'heldout') from a seed."""

    def __init__(self, seed: int, split: str = "train") -> None:
        if split not in ("train", "heldout"):
            raise ValueError(f"split {split!r}: must be 'train' or 'heldout'")
        self.rng = random.Random(seed)
        self.held = split == "heldout"

    def scene(self) -> tuple[list[str], dict[str, tuple[float, float, float]]]:
        rng = self.rng
        names = rng.sample(OBJECT_NAMES, rng.randint(1, 4))
        if rng.random() < 0.85:
            names.append("bin")
        names += [f for f in FIXTURES if rng.random() < 0.7]
        rng.shuffle(names)
        pos = {}
        for n in names:
            if n == "table":
                pos[n] = (0.55, 0.0, 0.40)
            elif n == "robot":
                pos[n] = (0.0, 0.0, 0.42)
            else:
                z = 0.44 if n == "bin" else TABLE_Z
                pos[n] = (round(rng.uniform(*TABLE_X), 3), round(rng.uniform(*TABLE_Y), 3), z)
        return names, pos

    def sample(self) -> Sample:
        rng = self.rng
        names, pos = self.scene()
        kind = rng.choices(KINDS, _WEIGHTS)[0]
        template = rng.choice(TEMPLATES[kind][self.held])
        movable = [n for n in names if n in OBJECT_NAMES]
        absent = [n for n in OBJECT_NAMES if n not in names]
        want_absent = rng.random() < ABSENT_P
        if want_absent or not movable:
            # half of the absent objects share a colour or a shape with one in the scene, so
            # that both words must match
            near = [n for n in absent if any(n.split("_")[0] == m.split("_")[0]
                                             or n.split("_")[1] == m.split("_")[1]
                                             for m in movable)]
            o = rng.choice(near if near and rng.random() < 0.5 else absent)
        else:
            o = rng.choice(movable)
        if kind == "stack":
            others = [n for n in movable if n != o]
            if want_absent or not others:
                d = rng.choice([n for n in OBJECT_NAMES if n != o])
            else:
                d = rng.choice(others)
        else:
            d = "bin"
        text = template.format(o=_phrase(rng, o), d=_phrase(rng, d))
        pre, post = rng.choice(FRAMES[self.held])
        instruction = pre + text + post
        named = [x for x, slot in ((o, "{o}"), (d, "{d}")) if slot in template]
        if kind == "unsupported":
            plan = f"{REFUSE} unsupported_action"
        elif any(x not in names for x in named):
            plan, kind = f"{REFUSE} absent_object", "absent"
        elif kind in ("place", "stack", "place_home"):
            plan = f"pick {o}\nplace {d}" + ("\nhome" if kind == "place_home" else "")
        elif kind in ("pick", "move_to", "push"):
            plan = f"{kind} {o}"
        else:
            plan = kind
        return Sample(instruction, names, pos, f"{plan}\n{END}", kind, template)


def render_scene(objects: list[str], positions: dict[str, tuple[float, float, float]],
                 rng: np.random.Generator, size: int = 32) -> np.ndarray:
    """A top-down uint8 [size, size, 3] RGB sketch of the table: coloured squares for the
    objects, a grey square for the bin, light noise (the model must not depend on it)."""
    img = np.empty((size, size, 3), np.uint8)
    img[:] = (150, 110, 70)
    for n in objects:
        if n in FIXTURES:
            continue
        x, y, _ = positions[n]
        r = int((x - TABLE_X[0]) / (TABLE_X[1] - TABLE_X[0]) * (size - 1))
        c = int((y - TABLE_Y[0]) / (TABLE_Y[1] - TABLE_Y[0]) * (size - 1))
        h = 3 if n == "bin" else 1
        colour = (120, 120, 120) if n == "bin" else RGB[n.split("_")[0]]
        img[max(r - h, 0):r + h + 1, max(c - h, 0):c + h + 1] = colour
    noise = rng.integers(-12, 13, img.shape)
    return np.clip(img.astype(np.int16) + noise, 0, 255).astype(np.uint8)
