"""Training of draft heads, outside the serving packages: the server never imports it
(``specserve train-eagle`` loads it on demand).

- ``eagle_train``: trains an EAGLE-3 head on the target's own answers (``train``);
- ``eagle_data``: distills those answers and the target's features for it;
- ``eagle_prompts``: the prompts it distills from.
"""
