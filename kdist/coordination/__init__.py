"""What the ranks of one `fit` share, just above `kdist.comm`.

Strategies, optimizers and callbacks all need to know the same few things
about a model that several ranks train together: which ranks those are
(`team`), which variables define it and whether the ranks hold them alike
(`model_state`, `consistency`), where the ranks meet at an epoch's end
(`joins`) and how their logs are averaged (`logs`). They import these from
here, downward; nothing here imports a layer above.
"""
