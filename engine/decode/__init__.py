"""The decode loop: engine (submit / abort / step / stats), scheduler, step pipeline, runner, rules."""
