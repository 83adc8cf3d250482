"""CheckpointMarks: the save runs once per mark with every worker paused, and a worker that runs out of data does
not keep the others waiting."""

from __future__ import annotations

import threading
import time

from cocosync.shadowsync.job.trainer import CheckpointMarks


def test_the_last_worker_to_arrive_saves_and_the_others_wait_for_it():
    paused: list[int] = []
    marks = CheckpointMarks(10, 0, 100, 2, save=lambda mark: paused.append(mark))
    done = threading.Event()

    def first():
        marks.after_batch(12)  # crosses mark 10: waits for the second worker
        done.set()

    t = threading.Thread(target=first)
    t.start()
    time.sleep(0.1)
    assert not done.is_set() and paused == []
    marks.after_batch(12)  # the second arrives: it saves, both go on
    t.join(5)
    assert done.is_set() and paused == [10] and marks.saved == [10]
    marks.after_batch(15)  # below the next mark (20): nothing
    assert paused == [10]


def test_a_worker_that_leaves_releases_the_ones_waiting():
    marks = CheckpointMarks(10, 0, 100, 2, save=lambda mark: None)
    t = threading.Thread(target=marks.after_batch, args=(10,))
    t.start()
    time.sleep(0.1)
    assert t.is_alive()
    marks.leave()  # the other worker ran out of data: the waiting one's mark is saved now
    t.join(5)
    assert not t.is_alive() and marks.saved == [10]


def test_marks_start_after_a_resumed_position_and_stop_at_the_limit():
    marks = CheckpointMarks(10, 25, 35, 1, save=lambda mark: None)
    marks.after_batch(29)
    marks.after_batch(31)
    marks.after_batch(45)  # 40 is past the limit
    assert marks.saved == [30]
