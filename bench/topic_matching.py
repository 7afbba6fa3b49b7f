"""
Topic matching: publishes per second with the subscription tree, against a
linear scan of every filter, for 100,000 subscriptions over 10,000 filters.

The filters follow a sensor hierarchy, sensors/<building>/<floor>/<room>/<kind>
(20 x 10 x 50 x 10 = 100,000 topics): 70% exact topics, 20% with '+' in one
or two levels, 10% ending in '#' (mostly a room, some a floor, a few a
building).  Each filter has 10 subscribers.  Half of the published topics
are subscribed exactly, half are drawn from the whole hierarchy, so each
publish matches a few filters, as most publishes do in a real broker.

The linear scan is what a broker without a tree does, done well: it
compares the topic with every distinct filter, level by level, with the
filters split into levels beforehand and the subscribers grouped by filter,
so it scans 10,000 filters, not 100,000 subscriptions.  Both are checked to
give the same subscribers first.

    python3 bench/topic_matching.py
    python3 bench/topic_matching.py --repetitions 9 --seed 2
"""

import argparse
import platform
import random
import statistics
import sys
import time

from dallal.topictree import SubscriptionTree

BUILDINGS = [f"b{number}" for number in range(20)]
FLOORS = [f"f{number}" for number in range(10)]
ROOMS = [f"r{number}" for number in range(50)]
KINDS = [
    "temperature",
    "humidity",
    "co2",
    "light",
    "motion",
    "door",
    "window",
    "power",
    "noise",
    "pressure",
]

FILTERS = 10_000
SUBSCRIBERS_PER_FILTER = 10
SUBSCRIBERS = 20_000
TREE_PUBLISHES = 20_000
SCAN_PUBLISHES = 1_000


def randomTopic(rng):
    return "/".join(
        ["sensors", rng.choice(BUILDINGS), rng.choice(FLOORS), rng.choice(ROOMS), rng.choice(KINDS)]
    )


def plusFilter(rng):
    """
    A random topic with '+' in one or two of its four variable levels.
    """
    levels = randomTopic(rng).split("/")
    for index in rng.sample(range(1, 5), rng.choice([1, 2])):
        levels[index] = "+"
    return "/".join(levels)


def multiLevelFilter(rng):
    """
    A random '#' filter: a room 90% of the time, a floor 9%, a building 1%.
    """
    depth = rng.choices([4, 3, 2], weights=[90, 9, 1])[0]
    return "/".join(randomTopic(rng).split("/")[:depth] + ["#"])


def makeFilters(rng):
    """
    FILTERS distinct filters: 70% exact, 20% '+', 10% '#'.
    """
    filters = set()
    for makeOne, share in [(randomTopic, 0.7), (plusFilter, 0.2), (multiLevelFilter, 0.1)]:
        target = len(filters) + int(FILTERS * share)
        while len(filters) < target:
            filters.add(makeOne(rng))
    return sorted(filters)


def makePublishes(rng, filters, count):
    """
    Topics to publish: half subscribed exactly, half from anywhere.
    """
    exact = [
        topicFilter for topicFilter in filters if "+" not in topicFilter and "#" not in topicFilter
    ]
    return [rng.choice(exact) if rng.random() < 0.5 else randomTopic(rng) for _ in range(count)]


def levelsMatch(filterLevels, topicLevels):
    """
    Whether a filter matches a topic, both split into levels.
    """
    for index, level in enumerate(filterLevels):
        if level == "#":
            return True
        if index == len(topicLevels):
            return False
        if level != "+" and level != topicLevels[index]:
            return False
    return len(filterLevels) == len(topicLevels)


def scanMatch(subscriptionsByLevels, topic):
    """
    The linear scan: every filter, every publish.
    """
    topicLevels = topic.split("/")
    reserved = topic.startswith("$")
    found = {}
    for filterLevels, subscribers in subscriptionsByLevels:
        # Wildcards in the first level do not reach '$' topics.
        if reserved and filterLevels[0] in ("+", "#"):
            continue
        if levelsMatch(filterLevels, topicLevels):
            for subscriber, value in subscribers.items():
                found.setdefault(subscriber, []).append(value)
    return found


def normalized(found):
    """
    A match with each subscriber's values in order: the tree and the scan
    find a subscriber's filters in different orders.
    """
    return {subscriber: sorted(values) for subscriber, values in found.items()}


def matchingFilters(found):
    """
    The filters of a match: each subscription's value is its filter.
    """
    return {topicFilter for values in found.values() for topicFilter in values}


def publishesPerSecond(match, topics):
    started = time.perf_counter()
    for topic in topics:
        match(topic)
    return len(topics) / (time.perf_counter() - started)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1)
    options = parser.parse_args(argv)
    rng = random.Random(options.seed)

    filters = makeFilters(rng)
    tree = SubscriptionTree()
    subscriptionsByLevels = []
    started = time.perf_counter()
    for topicFilter in filters:
        subscribers = {
            subscriber: topicFilter
            for subscriber in rng.sample(range(SUBSCRIBERS), SUBSCRIBERS_PER_FILTER)
        }
        for subscriber, value in subscribers.items():
            tree.add(topicFilter, subscriber, value)
        subscriptionsByLevels.append((topicFilter.split("/"), subscribers))
    building = time.perf_counter() - started

    publishes = makePublishes(rng, filters, TREE_PUBLISHES)
    matched = [tree.match(topic) for topic in publishes]
    for topic, found in zip(publishes[:SCAN_PUBLISHES], matched):
        if normalized(found) != normalized(scanMatch(subscriptionsByLevels, topic)):
            sys.exit(f"the tree and the scan disagree on {topic}")

    treeRates = []
    scanRates = []
    for _ in range(options.repetitions):
        treeRates.append(publishesPerSecond(tree.match, publishes))
        scanRates.append(
            publishesPerSecond(
                lambda topic: scanMatch(subscriptionsByLevels, topic),
                publishes[:SCAN_PUBLISHES],
            )
        )
    treeRate = statistics.median(treeRates)
    scanRate = statistics.median(scanRates)

    print(f"python {platform.python_version()} on {platform.machine()}, seed {options.seed}")
    print(
        f"{len(tree):,} subscriptions over {len(filters):,} filters "
        f"({tree.nodeCount:,} tree nodes, built in {building:.2f} s)"
    )
    print(
        f"per publish: {statistics.mean(len(found) for found in matched):.1f} subscribers "
        f"of {statistics.mean(len(matchingFilters(found)) for found in matched):.2f} "
        "matching filters on average"
    )
    print(f"median of {options.repetitions} repetitions:")
    print(f"  tree         {treeRate:>12,.0f} publishes/s  ({TREE_PUBLISHES:,} publishes each)")
    print(f"  linear scan  {scanRate:>12,.0f} publishes/s  ({SCAN_PUBLISHES:,} publishes each)")
    print(f"  ratio        {treeRate / scanRate:>12,.0f}x")
    print(
        "reproduce: python3 bench/topic_matching.py "
        f"--repetitions {options.repetitions} --seed {options.seed}"
    )


if __name__ == "__main__":
    main()
