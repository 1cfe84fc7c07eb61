"""Which held-out questions a model answers correctly on one reasoning-gym family, and how: each distinct
question's count among the draws, the reply (greedy, HF `generate` in float32) and the number of
"answer is" phrases in it (a counting list cut off at the token limit shows up as many).

    python scripts/base_successes.py [--model smollm2-135m] [--n 128] [--seed 0] [--max-new-tokens 64]
        [--family '{"leg_counting": {"min_animals": 1, "max_animals": 1, "max_instances": 2}}']

Used in docs/retention.md ("The two outside falls on fresh tasks").
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter

import torch

from posttrain.envs import get_domain
from posttrain.envs.extract import extract_answer, normalize_number
from posttrain.models import load_policy, load_tokenizer

LEGS = '{"leg_counting": {"min_animals": 1, "max_animals": 1, "max_instances": 2}}'


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--family", default=LEGS, help="the math domain's `datasets` option, as JSON")
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    domain = get_domain("math", datasets=json.loads(args.family))
    # the raw draws i = 0..n-1, repeats kept (evaluation now skips them: heldout_tasks)
    tasks = [domain.task("heldout", 0, i, seed=args.seed) for i in range(args.n)]
    tok = load_tokenizer(args.model)
    model = load_policy(args.model, dtype="float32")
    counts = Counter(t.prompt[-1].content for t in tasks)
    solved = 0
    for question, times in counts.most_common():
        task = next(t for t in tasks if t.prompt[-1].content == question)
        text = tok.apply_chat_template(
            [m.to_dict() for m in task.prompt], add_generation_prompt=True, tokenize=False
        )
        ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        reply = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        answer = extract_answer(reply).text
        ok = answer is not None and normalize_number(answer) == str(task.meta.get("answer"))
        solved += times * ok
        phrases = len(re.findall(r"answer\s*(?:is|:|=)", reply, re.IGNORECASE))
        mark = "SOLVED" if ok else "      "
        print(f"{mark} x{times:<3} gold {task.meta.get('answer')!s:<6} phrases {phrases:<2} {reply[:120]!r}")
    print(f"{len(tasks)} draws, {len(counts)} distinct questions, {solved} solved")


if __name__ == "__main__":
    main()
