"""The training harness and device runner of moe_ep (not part of the library): ``train.py``, its model
(``model.py``), result provenance (``provenance.py``), plots and the GPU harness."""
