#!/usr/bin/env python3
"""Checks an example run's metrics: STEPS logged steps, a first loss within
0.5 of ln(VOCAB) (an untrained VOCAB-way model), and the mean of the last
five at least 1 nat below it.  Usage: loss_goes_down.py METRICS STEPS VOCAB"""
import json
import math
import sys


def main(path, steps, vocab):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    loss = [r["loss"] for r in rows if "loss" in r]
    assert len(loss) == steps, f"expected {steps} logged steps, got {len(loss)}"
    first, last = loss[0], sum(loss[-5:]) / 5
    print(f"loss: first {first:.3f} (ln {vocab} = {math.log(vocab):.3f}), mean of the last 5 {last:.3f}")
    assert abs(first - math.log(vocab)) < 0.5, f"the first loss is not that of an untrained {vocab}-way model"
    assert last < first - 1.0, f"the loss did not go down by 1 nat in {steps} steps"


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
