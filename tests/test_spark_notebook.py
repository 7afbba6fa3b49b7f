"""
The notebook API: load() gives the events, and each question is a function
of them alone, in any order, agreeing with the report on the hand-written
log (tests/conftest_spark.py).
"""

import pytest

pytest_plugins = ["conftest_spark"]
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def events(spark, handWrittenLogs):
    import dallal_analytics as da

    loaded = da.load(spark, [str(handWrittenLogs)]).cache()
    yield loaded
    loaded.unpersist()


def test_each_question_alone(events, handWrittenSummary):
    from pyspark.sql import functions as F

    import dallal_analytics as da

    # The loss account first: it needs no other question to have run.
    loss = da.lossAccount(events).agg(F.sum("matched"), F.sum("inflight")).first()
    assert tuple(loss) == (handWrittenSummary["matched"], handWrittenSummary["inflight"])
    assert da.sessions(events).count() == handWrittenSummary["sessions"]
    topics = {row.topic: (row.publishes, row.deliveries) for row in da.topics(events).collect()}
    assert topics == {
        topic: (values["publishes"], values["deliveries"])
        for topic, values in handWrittenSummary["topics"].items()
    }
    assert da.errors(events).agg(F.sum("errors")).first()[0] == handWrittenSummary["errors"]
    assert da.latency(events).agg(F.sum("acks")).first()[0] == handWrittenSummary["acked"]
    assert da.messages(events).count() == handWrittenSummary["publishes"] + 1
    assert (
        da.traffic(events).agg(F.sum("publishes")).first()[0] == (handWrittenSummary["publishes"])
    )
    assert (
        da.health(events).agg(F.sum("pings_missed")).first()[0]
        == (handWrittenSummary["pings_missed"])
    )
    assert {row.broker for row in events.select("broker").distinct().collect()} == {"hub"}
