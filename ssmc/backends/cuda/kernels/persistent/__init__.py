"""Nonlinear recurrences with a recurrent matrix product (LSTM, GRU) as one persistent kernel: the
recurrent weights resident on chip for the whole sequence, every block busy on each step, one grid
barrier a step (docs/design/persistent-rnn.md).

    analysis.py   which programs fit (`analyse`: one product of a renamed state, an element-wise cell)
                  and how a shape splits over blocks (`plan`), or why not
    forward.py    the kernel's CUDA C, the cell printed from the IR
    runner.py     `PersistentLoop` (the runner contract, the step loop as fallback), `persistent_loop`
                  (what `step_loop.step_loop` returns where a program fits)
"""
