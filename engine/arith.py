"""Integer arithmetic the layers share."""


def ceil_div(numerator: int, denominator: int) -> int:
    """The smallest integer >= numerator / denominator (positive denominators)."""
    return -(-numerator // denominator)


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return ceil_div(value, multiple) * multiple
