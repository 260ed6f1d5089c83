"""The decode loop: engine (submit / abort / step / stats); scheduler/ (who runs, each step's rows,
applying what a step produced); batch (the rows crossing to the step side); step/ (a batch in, an
output out); search/ (a window as several hypotheses)."""
