"""Decoding images into rows: the backends' entry point (``images``), the Pillow pipeline
(``decode_pil``) and the torchvision and torch one (``decode_tensor``, ``resize_tensor``,
``jpeg_header``). Importing this package imports neither Pillow nor torch."""
