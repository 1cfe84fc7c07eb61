"""Letter grades from scores out of 100."""

BOUNDS = [(90, "A"), (80, "B"), (70, "C"), (60, "D")]


def letter(score):
    for bound, grade in BOUNDS:
        if score > bound:
            return grade
    return "F"
