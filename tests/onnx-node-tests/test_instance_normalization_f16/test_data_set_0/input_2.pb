
BBJ7¬a5f/