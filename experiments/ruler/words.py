"""Word material for the synthetic tasks, shipped inline so generation never downloads."""

from __future__ import annotations

import random
import string

NOISE_SENTENCE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

# Common English nouns and adjectives (single tokens or short in most BPE vocabularies).
WORDS = """
apple river mountain garden window pencil candle silver forest ocean bridge castle dragon
engine planet rocket shadow thunder winter summer autumn spring market island desert valley
meadow harbor temple palace village cottage kitchen library museum theater station airport
anchor arrow basket blanket bottle bucket button camera carpet chair clock cloud coffee
copper cotton crystal curtain diamond dolphin eagle feather finger flower fountain glove
hammer helmet honey horse jacket jungle ladder lantern lemon lizard magnet marble mirror
monkey needle orange oyster paddle parrot pepper piano pillow pirate planet pocket potato
puzzle rabbit ribbon saddle salmon sandal scarf shovel socket spider sponge statue stove
sugar tablet teapot tiger tomato tunnel turtle umbrella velvet violin wagon walnut whistle
wizard yogurt zebra amber azure bright calm clever crimson dusty eager fancy gentle golden
happy humble icy jolly lively lucky mellow misty noble olive proud quiet rapid rusty silent
smooth sunny swift tender tiny vivid warm wild witty young brave cheerful dizzy fierce
fluffy frozen gloomy graceful hollow lonely mighty narrow polite purple scarlet shiny sleepy
spotty sticky stormy sweet thirsty tidy velvet violet wooden yellow zesty acorn badger beacon
biscuit bramble canyon cedar cherry cobalt comet coral cricket dune ember falcon fern fig
garnet glacier granite harvest hazel heron iris ivory jasmine juniper kettle lagoon lilac
maple meteor mint moss nectar nutmeg orchid otter pebble pine plume prairie quartz quill
raven reef saffron sage sapphire sequoia sparrow spruce tulip tundra walrus willow zephyr
""".split()


def unique_words(rng: random.Random, count: int, exclude: set[str] = frozenset()) -> list[str]:
    pool = sorted(set(WORDS) - set(exclude))
    if count > len(pool):
        raise ValueError(f"asked for {count} distinct words, the list holds {len(pool)}")
    return rng.sample(pool, count)


def magic_number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def coded_word(rng: random.Random, length: int = 5) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(length))


def var_name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
