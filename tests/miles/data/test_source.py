"""miles.data.source.DataSource: the epoch-shuffled cursor over the rows."""

from __future__ import annotations

import pytest

from miles.data import DataSource

N = 7


def _rows(n: int = N) -> list[dict[str, str]]:
    return [{"prompt": f"p{i}", "label": str(i)} for i in range(n)]


def _ids(rows) -> list[int]:
    return [int(r["label"]) for r in rows]


def test_empty_rows_rejected():
    with pytest.raises(ValueError, match="empty"):
        DataSource([], seed=0)


def test_reading_rows_does_not_move_the_cursor():
    source = DataSource(_rows(), seed=1)
    first = source.rows_at(source.position, 3)
    assert source.position == 0
    assert source.rows_at(source.position, 3) == first
    assert source.rows_at(source.position, 5)[:3] == first
    assert source.position == 0


def test_position_moves_the_window():
    source = DataSource(_rows(), seed=1)
    window = source.rows_at(source.position, 5)
    source.position = 2
    assert source.rows_at(source.position, 3) == window[2:5]


def test_each_epoch_is_a_permutation():
    source = DataSource(_rows(), seed=5)
    epochs = 4
    walk = _ids(source.rows_at(source.position, N * epochs))
    orders = [walk[e * N : (e + 1) * N] for e in range(epochs)]
    for order in orders:
        assert sorted(order) == list(range(N))
    # Epochs are reshuffled: with 7! orders, four identical epochs would be a broken shuffle.
    assert len({tuple(o) for o in orders}) > 1


def test_epoch_rollover_from_a_set_position():
    source = DataSource(_rows(), seed=5)
    walk = _ids(source.rows_at(source.position, 3 * N))
    source.position = N - 2  # straddles the end of epoch 0 and the start of epoch 1
    assert _ids(source.rows_at(source.position, 4)) == walk[N - 2 : N + 2]
    source.position = 2 * N + 3
    assert _ids(source.rows_at(source.position, 2)) == walk[2 * N + 3 : 2 * N + 5]
    # Going back to an earlier epoch gives the same order again.
    source.position = 0
    assert _ids(source.rows_at(source.position, N)) == walk[:N]


def test_batches_cover_each_row_once_per_epoch():
    source = DataSource(_rows(), seed=2)
    seen = []
    for _ in range(7):  # 7 batches of 3 = 21 = 3 epochs
        seen += _ids(source.rows_at(source.position, 3))
        source.position += 3
    for e in range(3):
        assert sorted(seen[e * N : (e + 1) * N]) == list(range(N))


def test_same_seed_same_order_different_seed_different_order():
    rows = _rows(50)
    a = _ids(DataSource(rows, seed=11).rows_at(0, 100))
    b = _ids(DataSource(rows, seed=11).rows_at(0, 100))
    c = _ids(DataSource(rows, seed=12).rows_at(0, 100))
    assert a == b
    assert a != c
    assert sorted(c[:50]) == list(range(50))


def test_shuffle_actually_shuffles():
    rows = _rows(50)
    assert _ids(DataSource(rows, seed=0).rows_at(0, 50)) != list(range(50))


def test_no_shuffle_keeps_order():
    source = DataSource(_rows(), seed=3, shuffle=False)
    assert _ids(source.rows_at(source.position, 2 * N + 2)) == list(range(N)) * 2 + [0, 1]


def test_state_dict():
    source = DataSource(_rows(), seed=4)
    source.position = 2 * N + 5
    assert source.state_dict() == {"position": 2 * N + 5, "epoch": 2, "offset": 5, "seed": 4}


def test_state_dict_round_trip():
    source = DataSource(_rows(), seed=4)
    source.position = N + 3
    expected = source.rows_at(source.position, 6)
    restored = DataSource(_rows(), seed=4)
    restored.load_state_dict(source.state_dict())
    assert restored.position == N + 3
    assert restored.rows_at(restored.position, 6) == expected
    assert restored.state_dict() == source.state_dict()


def test_load_state_without_seed():
    source = DataSource(_rows(), seed=4)
    source.load_state_dict({"position": 9})
    assert source.position == 9


def test_seed_mismatch():
    source = DataSource(_rows(), seed=4)
    source.position = 3
    state = source.state_dict()
    other = DataSource(_rows(), seed=5)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
    assert other.position == 0
