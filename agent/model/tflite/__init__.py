"""A `.tflite` file read as a flatbuffer: its signatures, tensors, ops and layout."""
