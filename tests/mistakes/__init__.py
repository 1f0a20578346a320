"""Every chapter's catalogue of wrong solutions: the mistakes learners really make,
each with the message fragment its checker must give. Importing this package
registers them into :data:`dtlab.exercises.REGISTRY` (``tests/conftest.py`` does,
for every test); ``tests/test_exercises.py`` proves each one rejected. Test data,
kept out of the package a learner installs (chapter 05's demonstrated mistake
stays there: ``dtlab.exercises.ch05_mistakes``)."""

from tests.mistakes import (  # noqa: F401 - each registers its chapter's mistakes
    ch00,
    ch01,
    ch02,
    ch03,
    ch04,
    ch05,
    ch06,
    ch07,
    ch08,
    ch09,
    ch10,
    ch11,
    ch12,
    ch13,
)
