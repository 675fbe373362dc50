"""Word lists the task generators draw from (small, fixed, so samples are reproducible from a seed)."""

from probe.errors import InvalidValueError

ADJECTIVES = (
    "amber brave calm dusty eager fancy gentle hollow icy jolly keen lively mellow narrow odd "
    "plain quick rusty shiny tidy upper vivid wobbly young zesty bold crisp damp faint grim "
    "hasty jumpy lanky misty noisy proud rapid sour tense woolly"
).split()
NOUNS = (
    "anchor badge candle desk engine falcon garage harbor island jacket kettle ladder magnet "
    "needle orchard pepper quarry rocket saddle tunnel umbrella valley wagon yacht zipper "
    "basket cactus donkey feather glacier hammer lantern meadow nickel otter pillow river "
    "spoon tiger walnut"
).split()

# Story world (bAbI / BABILong qa1-qa3 and CDT 002 App. A.1 Fig. 12).
CHARACTERS = "Mary John Daniel Sandra Mike Emma Bill Fred Julie Jeff Anna Tom".split()
PLACES = "kitchen garden office bedroom bathroom hallway cellar balcony library garage".split()
OBJECTS = "apple football milk book key ball box hat lamp cup".split()
MOVE = ("went to", "journeyed to", "travelled to", "moved to")
PICK = ("picked up", "took", "grabbed", "got")
DROP = ("dropped", "put down", "discarded", "left")

# Multi-value needles (LOGO 003 App. B Fig. 8).
CITIES = (
    "San Francisco",
    "New York",
    "Lisbon",
    "Nairobi",
    "Oslo",
    "Lima",
    "Hanoi",
    "Perth",
    "Montreal",
    "Krakow",
    "Seville",
    "Osaka",
)
SHARED_ACTIVITIES = (
    "eat a sandwich",
    "fly a kite",
    "ride a bicycle",
    "play chess",
    "bake bread",
    "watch the sunset",
    "paint a mural",
    "feed the ducks",
)
LOCAL_ACTIVITIES = (
    "sit in Dolores Park",
    "visit the old harbor",
    "climb the city hill",
    "walk along the river",
    "tour the botanical garden",
    "listen to street music",
    "browse the night market",
    "swim at the public pool",
    "see the cathedral",
    "take the cable car",
)


def keys(rng, count: int) -> list[str]:
    """``count`` distinct random ``adjective-noun`` keys (LongEval's LRT-NL line indices)."""
    total = len(ADJECTIVES) * len(NOUNS)
    if count > total:
        raise InvalidValueError(f"only {total} distinct keys exist, asked for {count}")
    chosen = rng.choice(total, count, replace=False)
    return [f"{ADJECTIVES[i // len(NOUNS)]}-{NOUNS[i % len(NOUNS)]}" for i in chosen]
