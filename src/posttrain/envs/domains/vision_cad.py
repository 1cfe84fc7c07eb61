"""`vision.cad_drawing`: questions on a 2-D engineering drawing of a `cad.modeling` part (cad_drawing.py
renders it): read one dimension, or count the round through-holes. The ground truth is the part's own
parameters. Single turn, answer in `<answer>` tags (vision_common.py); needs no CadQuery.

Levels: 0 a dimension of a block or a cylinder (cad.modeling level 0); 1 how many round through-holes
(a block with a bore, a tube or a gear blank: 1; a plate with holes or a rounded plate: 2 or 4; a
flange: 4-9, each group a third of the tasks); 2 a dimension of a level 1-2 part; 3 a dimension of a level-3 part (more
views, hidden lines and notes). Train and held-out split by the part, as cad.modeling does (the same
key), so a part is held out in both domains or in neither. The image's text description is one
constant sentence: a text-only model reads nothing that tells the answer.
"""

from __future__ import annotations

import random

from posttrain.envs.domains.cad_drawing import DESCRIPTION, PHRASES, mm_text, render_part, sheet_of
from posttrain.envs.domains.cad_modeling import FAMILIES
from posttrain.envs.domains.vision_common import AnswerDomain, vision_prompt
from posttrain.envs.registry import register_env
from posttrain.types import Task

HOLES_QUESTION = (
    "How many round through-holes does this part have? Count the central bore too, if it has one."
)
PART_LEVELS = {0: [0], 1: [1, 2, 3], 2: [1, 2], 3: [3]}
BY_FAMILY = {f(random.Random(0)).family: f for level in FAMILIES.values() for f in level}
# Level 1 draws a group, then a family in it, so that no count dominates: a constant answer scores
# at most about 1/3 (1 for a bored part; 2 or 4 for plates; 4-9 for a flange).
HOLE_GROUPS = (("block_with_bore", "tube", "gear_blank"), ("plate_with_holes", "rounded_plate"), ("flange",))


def dimension_question(name: str) -> str:
    return f"What is the {PHRASES[name]}, in mm, as dimensioned in the drawing? Answer with the number."


@register_env("vision.cad_drawing")
class CadDrawingDomain(AnswerDomain):
    description = "read a dimension or count the holes in a CAD part's engineering drawing (image input)"
    difficulties = [0, 1, 2, 3]

    def task(self, split: str, difficulty: int, index: int, seed: int = 0) -> Task:
        def make(rng: random.Random):
            if difficulty == 1:
                family = BY_FAMILY[rng.choice(rng.choice(HOLE_GROUPS))]
            else:
                family = rng.choice([f for lvl in PART_LEVELS[difficulty] for f in FAMILIES[lvl]])
            part = family(rng)
            sheet = sheet_of(part.family, part.dims)
            values = {d.name: d.value for v in sheet.views.values() for d in v.dims}
            values.update({n.name: n.value for n in sheet.notes})
            if difficulty == 1:
                asked, question, answer = "holes", HOLES_QUESTION, str(sheet.holes)
            else:
                asked = rng.choice(sorted(values))
                question, answer = dimension_question(asked), mm_text(values[asked])

            def build() -> Task:
                drawing = render_part(part.family, part.dims)
                meta = {
                    "answer": answer,
                    "question": question,
                    "asked": asked,
                    "family": part.family,
                    "part": part.description,
                    "dimensions": {k: mm_text(v) for k, v in sorted(values.items())},
                    "holes": sheet.holes,
                }
                prompt = vision_prompt(question, drawing.pixels, DESCRIPTION)
                return Task("", self.name, difficulty, prompt, meta=meta)

            # the split goes by the part alone, with cad.modeling's key: a part held out there is held
            # out here, whatever is asked about it
            return f"{part.family}|{part.dims}", build

        return self.draw(split, difficulty, index, seed, make)
