"""Evaluation, apart from the library core: real text (``texts``), the attention-output error metric
(``fidelity``), the error-vs-bits study (``study``) and its reports (``report``)."""
