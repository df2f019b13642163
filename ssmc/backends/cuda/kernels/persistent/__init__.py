"""Nonlinear recurrences with a recurrent matrix product (LSTM, GRU) as one persistent kernel: the
recurrent weights resident on chip for the whole sequence, every block busy on each step, one grid
barrier a step (docs/design/persistent-rnn.md)."""
