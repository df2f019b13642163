"""One example per recurrence family; each has SPEC, LAYOUT, make_inputs, reference, main."""
