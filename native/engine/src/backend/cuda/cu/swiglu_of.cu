
  auto swiglu = [](float g, float u) -> T {
    const T s = static_cast<T>(1.f / (1.f + expf(-g)));
    const T a = static_cast<T>(g * static_cast<float>(s));
    return static_cast<T>(static_cast<float>(a) * u);
  };
