from grading.letters import letter


def test_inside():
    assert letter(95) == "A" and letter(85) == "B" and letter(10) == "F"


def test_on_the_boundary():
    assert letter(90) == "A"
    assert letter(60) == "D"
