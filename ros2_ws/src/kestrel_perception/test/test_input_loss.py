"""Messages taken and lost per sensor (core/loss.py): publisher sequence numbers when the rmw
gives them, stamp gaps otherwise."""

from __future__ import annotations

from kestrel_perception.core.loss import (MAX_WRITERS, InputLoss, SequenceGaps,
                                          message_sequence)

MS = 1_000_000
A, B = b"writer-a", b"writer-b"


def _counter():
    counts: dict[str, int] = {}

    def count(name: str, k: int) -> None:
        counts[name] = counts.get(name, 0) + k

    return counts, count


def test_sequence_gaps_count_exactly_what_was_overwritten_from_the_first_message() -> None:
    """Overloaded from its first message (no period to learn): every message the node did not
    take is counted, per publisher."""
    counts, count = _counter()
    g = SequenceGaps("lost_camera_0", count)
    taken = [5, 8, 11, 12, 20]  # the publisher sent 5..20
    assert [g.add(s, A) for s in taken] == [0, 2, 2, 0, 7]
    assert g.lost == 11 == 20 - 5 + 1 - len(taken) and counts == {"lost_camera_0": 11}
    assert g.add(3, B) == 0 and g.add(6, B) == 2  # a second publisher: counted on its own
    assert g.add(6, B) == 0 and g.add(4, B) == 0  # a duplicate, a late message: no gap
    assert g.lost == 13


def test_sequence_restart_and_forgotten_publishers_start_over() -> None:
    g = SequenceGaps("lost_lidar")
    g.add(1, A)
    g.restart()  # the node took nothing for a while: what was sent meanwhile is not lost
    assert g.add(50, A) == 0 and g.add(51, A) == 0
    for k in range(MAX_WRITERS):  # A is now the least recently heard of: forgotten
        g.add(1, bytes([k]))
    assert g.add(60, A) == 0 and g.lost == 0


def test_input_loss_counts_received_and_prefers_sequence_numbers() -> None:
    counts, count = _counter()
    loss = InputLoss("camera_0", 1.0, count)
    period = 33 * MS
    for i in (1, 2, 3, 9, 10, 40):  # stamps and numbers alike: 5 + 29 lost
        loss.add(i * period, i, A)
    assert counts == {"received_camera_0": 6, "lost_camera_0": 34}
    assert loss.received == 6 and loss.lost == 34 and loss.stamps.lost == 0
    loss.restart()
    loss.add(100 * period, 100, A)
    assert loss.lost == 34  # no gap across a restart


def test_input_loss_falls_back_to_stamps_without_sequence_numbers() -> None:
    counts, count = _counter()
    loss = InputLoss("lidar", 1.0, count)
    period = 100 * MS
    for i in (0, 1, 2, 3, 4, 5, 8):  # period learned, then 6 and 7 missing
        loss.add(i * period, *message_sequence(None))
    assert counts == {"received_lidar": 7, "lost_lidar": 2} and loss.lost == 2


def test_message_sequence_from_rclpy_message_info() -> None:
    info = {"source_timestamp": 1, "received_timestamp": 2, "publication_sequence_number": 7,
            "reception_sequence_number": None,
            "publisher_gid": {"implementation_identifier": "rmw_fastrtps_cpp", "data": A}}
    assert message_sequence(info) == (7, A)
    assert message_sequence(None) == (None, None)
    assert message_sequence({**info, "publication_sequence_number": None}) == (None, None)
    assert message_sequence({**info, "publisher_gid": None}) == (None, None)
